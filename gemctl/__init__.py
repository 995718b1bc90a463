"""gemctl: the command line of GEM Platform (parse, call gem_platform, render)."""
