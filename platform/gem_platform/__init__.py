"""GEM Platform: recipes, data, model, parallelism, training and tracking for GEM-style
recommendation models. The CLI (`gemctl`) is a thin layer over this package."""

__version__ = "0.1.0"
