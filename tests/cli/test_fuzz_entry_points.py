"""Hostile input at every entry point gemctl reads from the user: recipe YAML, sweep specs,
results files for compare, a dataset's meta.json, store and cluster URIs, and the command line
itself. Whatever the
input, the command ends by itself with no traceback: exit code 2 with one paragraph naming the
problem (0 where the input is valid; compare may also judge a gate: 1 or 3).

In-process (typer's CliRunner) and few examples each, so each test takes seconds."""

from __future__ import annotations

import json
import math

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gemctl.main import app
from tests.cli.conftest import REPO
from tests.conftest import free_port

DEMO = str(REPO / "recipes" / "demo.yaml")
CLOSED_PORT = free_port()  # nothing listens there: no address below reaches a live service
SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
MARKUP = st.sampled_from(["[/]", "[bold]x", "a[/red]b", "$\\frac{$", "x\\", "é日本", "\U0001f642",
                          "", " ", "a,b=c", "\x00", "\n"])
NAMES = TEXT | MARKUP


def run(*args: str, allowed: tuple[int, ...] = (0, 2)):
    result = CliRunner().invoke(app, list(args), catch_exceptions=True, prog_name="gemctl")
    out = result.output + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        (args, repr(result.exception))
    assert "Traceback" not in out, (args, out)
    assert result.exit_code in allowed, (args, result.exit_code, out)
    if result.exit_code == 2:
        assert "error" in out.lower() or "Usage:" in out, (args, out)
    return result


# -- recipe YAML ------------------------------------------------------------------------

SECTIONS = ["model", "train", "data", "loader", "parallel", "precision", "tracking", "name",
            "tags", "steps", "workers", "attention", "path", "synthetic", "base", "arms"]
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | MARKUP
TREES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.sampled_from(SECTIONS) | TEXT, kids, max_size=4), max_leaves=15)


def _deep(n: int, kind: str) -> str:
    return {"flow": "a: " + "[" * n + "]" * n, "map": "a: " + "{b: " * n + "1" + "}" * n,
            "block": "a:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, n))}[kind]


@SETTINGS
@given(st.one_of(TREES.map(lambda t: yaml.safe_dump(t, allow_unicode=True)), TEXT,
                 st.tuples(st.integers(30, 3000), st.sampled_from(["flow", "map", "block"]))
                 .map(lambda a: _deep(*a)), st.binary(max_size=40).map(repr)))
@example("name: x\ntracking: {tags: {'[/]': v}}\n")
@example("model: &a [*a]\n")
def test_recipe_yaml(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(text, errors="surrogatepass")
    run("validate", str(path))


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["train.steps", "tracking.tags", "model", "x[/]",
                                           "tracking.run_name", "parallel.workers", ""]),
                          TEXT | MARKUP | st.integers().map(str)), max_size=3))
def test_recipe_overrides(pairs):
    run("validate", DEMO, *[a for k, v in pairs for a in ("--set", f"{k}={v}")])


# -- sweep specs ------------------------------------------------------------------------

BASES = st.sampled_from(["base.yaml", "list.yaml", "spec.yaml", "missing.yaml", "", ".",
                         "x" * 300, "a\x00b", "../../../../etc/passwd"]) | TEXT
OVERRIDES = st.lists(st.sampled_from(["train.steps=3", "model.attention=block64", "nonsense",
                                      "train.steps=[[", "x[/]=1", "=", "tracking.tags={a: b}"])
                     | TEXT, max_size=3)
SPECS = st.fixed_dictionaries(
    {"name": st.sampled_from(["s", "ok-1"]) | NAMES, "base": BASES | st.integers()},
    optional={"arms": st.dictionaries(NAMES, OVERRIDES | st.dictionaries(TEXT, SCALARS,
                                                                          max_size=2) | SCALARS,
                                      max_size=3),
              "grid": st.dictionaries(st.sampled_from(["train.steps", "model.attention"]) | TEXT,
                                      st.lists(SCALARS, max_size=3), max_size=2),
              "seeds": st.lists(st.integers(-3, 5), max_size=3) | SCALARS,
              "baseline": NAMES, "set": OVERRIDES, "max_concurrent": SCALARS,
              "gates": st.dictionaries(st.sampled_from(["max_ne_regression", "x"]),
                                       SCALARS | st.just("0.1%"), max_size=2)})


@SETTINGS
@given(SPECS)
@example({"name": "s", "base": "list.yaml", "arms": {"a": []}})
@example({"name": "s", "base": "base.yaml", "grid": {"train.steps": [2, 3]}})
def test_sweep_spec(tmp_path_factory, spec):
    root = tmp_path_factory.mktemp("sweep")
    (root / "base.yaml").write_text("name: b\ntrain: {steps: 2}\n")
    (root / "list.yaml").write_text("- a\n")
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    run("validate", str(path))
    # the sweep command reads the spec itself; an arm no spec has stops it before any trial
    run("sweep", str(path), "--in-process", "--arms", "\x01none", "--out", str(root / "r.json"))
    assert not (root / "r.json").exists()


# -- results files for compare -----------------------------------------------------------

NUMBERS = (st.floats() | st.integers(-10**30, 10**30) | st.sampled_from([math.nan, math.inf])
           | TEXT | st.none() | st.booleans())
METRICS = st.dictionaries(st.sampled_from(["eval/ne_ctr", "eval/auc_ctr", "perf/qps",
                                           "eval/ne_cvr", "eval/ne_" + "[/]"]) | TEXT, NUMBERS,
                          max_size=4)
TRIAL = st.fixed_dictionaries(
    {"arm": st.sampled_from(["base", "arm"]) | NAMES | st.integers(),
     "seed": st.integers(0, 3).map(str) | st.integers(0, 3) | TEXT | st.just("9" * 5000),
     "metrics": METRICS | SCALARS},
    optional={"run_id": TEXT | st.integers(), "commit": TEXT | st.integers() | st.none(),
              "history": st.dictionaries(TEXT, st.lists(st.lists(NUMBERS, max_size=3),
                                                        max_size=2), max_size=2) | SCALARS})
SWEEP_RESULTS = st.fixed_dictionaries(
    {"format": st.just("gem-sweep-results/1"), "trials": st.lists(TRIAL, max_size=6) | SCALARS},
    optional={"baseline": NAMES | SCALARS, "sweep": TEXT | SCALARS, "arms": SCALARS})
COMPARISONS = st.fixed_dictionaries(
    {"format": st.just("gem-comparison/1"),
     "arms": st.lists(st.fixed_dictionaries(
         {"arm": NAMES | st.integers(), "seeds": st.lists(st.integers(0, 3) | TEXT, max_size=3),
          "run_ids": st.lists(TEXT, max_size=3),
          "per_seed": st.dictionaries(st.sampled_from(["eval/ne_ctr", "perf/qps"]),
                                      st.lists(NUMBERS, max_size=3), max_size=2)},
         optional={"commits": st.dictionaries(TEXT, TEXT | st.integers(), max_size=2)}),
         max_size=3) | SCALARS},
    optional={"baseline": NAMES | SCALARS, "sweep_ids": st.lists(TEXT, max_size=2) | SCALARS})


def _dump(body) -> str:
    return json.dumps(body, allow_nan=True, default=str)


@SETTINGS
@given(SWEEP_RESULTS | COMPARISONS | TREES, st.booleans())
def test_results_file(tmp_path_factory, body, as_json):
    path = tmp_path_factory.mktemp("results") / "r.json"
    path.write_text(_dump(body), errors="surrogatepass")
    result = run("compare", str(path), "--no-plot", "--max-ne-regression", "0.1%",
                 "--max-qps-drop", "5%", *(["--json"] if as_json else []),
                 allowed=(0, 1, 2, 3))
    if as_json and result.exit_code != 2:
        json.loads(result.stdout, parse_constant=lambda c: (_ for _ in ()).throw(
            AssertionError(f"non-JSON token {c}")))


# Files compare accepts: hostile names and values in the right places, so the plots are drawn.
PLOTTED = st.fixed_dictionaries({
    "format": st.just("gem-sweep-results/1"), "baseline": st.just("base"),
    "trials": st.lists(st.fixed_dictionaries({
        "arm": st.sampled_from(["base", "base"]) | MARKUP.filter(bool) | NAMES.filter(bool),
        "seed": st.integers(0, 3),
        "metrics": st.dictionaries(st.sampled_from(["eval/ne_ctr", "eval/auc_ctr", "perf/qps"]),
                                   st.floats(0.1, 2) | st.sampled_from([math.nan, math.inf]),
                                   max_size=3),
        "history": st.dictionaries(st.sampled_from(["eval/ne_ctr", "train/ne_ctr"]), st.lists(
            st.tuples(st.integers(0, 5), st.floats(0.1, 2) | st.just(math.nan)), max_size=3),
            max_size=2)}), min_size=1, max_size=6)})


@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(PLOTTED)
def test_results_file_with_plots(tmp_path_factory, body):
    root = tmp_path_factory.mktemp("plots")
    path = root / "r.json"
    path.write_text(_dump(body), errors="surrogatepass")
    run("compare", str(path), "--plot", str(root / "ne.png"), "--max-ne-regression", "0.1%",
        allowed=(0, 1, 2, 3))


# -- a dataset's meta.json (gemctl plan --meta) ----------------------------------------------

META = {"source": "synthetic", "num_items": 50, "num_action_types": 4,
        "sparse_features": [{"name": "user_id", "vocab_size": 10},
                            {"name": "tags", "vocab_size": 5, "multi_hot": True}],
        "dense_dim": 4, "num_train": 100, "num_eval": 20, "ctr_base_rate": 0.1,
        "cvr_base_rate": 0.2, "planted_auc": None, "max_seq_len": 8, "num_categories": 3,
        "extra": {}}
HUGE = st.sampled_from([2**31, 2**53, 2**62, 2**63, 2**64, 10**30, -1, 0])
FIELD_VALUES = NUMBERS | HUGE | SCALARS | st.lists(HUGE | TEXT, max_size=2) | \
    st.lists(st.fixed_dictionaries({"name": NAMES, "vocab_size": HUGE | NUMBERS}), max_size=2)
METAS = st.builds(lambda changes, dropped: {k: v for k, v in {**META, **changes}.items()
                                            if k not in dropped},
                  st.dictionaries(st.sampled_from(sorted(META)) | TEXT, FIELD_VALUES,
                                  max_size=3),
                  st.sets(st.sampled_from(sorted(META)), max_size=2))


@SETTINGS
@given(METAS.map(_dump) | TREES.map(_dump) | TEXT | st.just("{" * 5000))
@example(_dump(META))
@example(_dump({**META, "num_items": 2**62}))
@example(_dump({**META, "sparse_features": [{"name": "u", "vocab_size": 2**62}]}))
@example(_dump({**META, "dense_dim": 2**62}))
@example(_dump({**META, "num_action_types": 2**62}))
def test_dataset_meta(tmp_path_factory, text):
    folder = tmp_path_factory.mktemp("meta")
    (folder / "meta.json").write_text(text, errors="surrogatepass")
    run("plan", DEMO, "--meta", str(folder / "meta.json"), "--json")


# -- URIs: --tracking-uri and --address --------------------------------------------------

HOSTS = st.sampled_from(["127.0.0.1", "localhost", "[::1]", "[::1", "::1", "", "h st", "%zz",
                         "127.0.0.1:", "[", "]", "@", "a@b@127.0.0.1"])
PORTS = st.sampled_from([f":{CLOSED_PORT}", "", ":0", ":-1", ":70000", ":x", ":", ":99999999"])
USERINFO = st.sampled_from(["", "u:secret@", "secret@", ":@", "u:p:q@"]) | \
    TEXT.map(lambda t: t + "@")
PATHS = st.sampled_from(["", "/", "/db", "/?token=secret", "/#x"]) | TEXT


def _uri(scheme: str, userinfo: str, host: str, port: str, path: str) -> str:
    return f"{scheme}://{userinfo}{host}{port}{path}"


# (sqlite URIs that work would each build a new store for seconds: the examples cover sqlite)
URIS = st.builds(_uri, st.sampled_from(["http", "https", "HTTP", "postgresql", "mysql", "mssql",
                                        "postgresql+psycopg2", "postgresql+nope", "foo", "",
                                        "file"]) | TEXT.filter(str.isalpha),
                 USERINFO, HOSTS, PORTS, PATHS) | TEXT


@SETTINGS
@given(URIS)
@example("sqlite:////no/such/folder/x.db")
@example("sqlite:///" + "x" * 300 + "/m.db")
@example("sqlite:///.")
@example("http://u:secret@[::1")
@example("://u:secret@127.0.0.1:1")
@example("http://127.0.0.1\x80")  # a host name the IDNA codec refuses before any lookup
def test_tracking_uri(tmp_path_factory, monkeypatch, uri):
    monkeypatch.chdir(tmp_path_factory.mktemp("uri"))
    result = run("runs", "--tracking-uri", uri)
    assert "secret" not in result.output + result.stderr or "secret" in uri.split("@")[-1]


ADDRESSES = st.builds(_uri, st.sampled_from(["ray", "gcs", "http", "https", "RAY", "tcp"]),
                      st.just(""), HOSTS, PORTS, PATHS) | TEXT.filter(
    lambda t: t.strip() not in ("", "auto", "local"))


@SETTINGS
@given(ADDRESSES)
@example("ray://[::1")
@example(f"127.0.0.1:{CLOSED_PORT}")
def test_cluster_address(tmp_path_factory, monkeypatch, address):
    monkeypatch.chdir(tmp_path_factory.mktemp("address"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run("submit", DEMO, "--address", address, "--tracking-uri", "sqlite:///m.db")


# -- the command line --------------------------------------------------------------------

OPTIONS = ["--set", "-s", "--json", "--world", "--gpus-per-host", "--hosts-per-zone",
           "--meta", "--out", "--baseline", "--max-ne-regression", "--max-auc-drop",
           "--max-qps-drop", "--no-plot", "--limit", "-n", "--experiment", "--sweep",
           "--sweeps", "--tracking-uri", "--schema", "-h", "--nope", "--"]
VALUES = st.sampled_from([DEMO, "0", "-1", "1e9", "131073", "nan", "inf", "%", "0.1%", "",
                          "[/]", "x.json", "sqlite:///m.db", "a=b", "train.steps=2"]) | TEXT
ARGS = st.lists(st.sampled_from(OPTIONS) | VALUES, max_size=6)


@SETTINGS
@given(st.sampled_from(["validate", "plan", "compare", "runs", "status", "logs", "stop",
                        "nope", "data"]), ARGS)
@example("plan", [DEMO, "--world", "1000000000"])
@example("compare", ["[/].json", "--max-ne-regression", "abc"])
def test_command_line(tmp_path_factory, monkeypatch, command, args):
    monkeypatch.chdir(tmp_path_factory.mktemp("argv"))
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{CLOSED_PORT}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///m.db")
    run(command, *[a for a in args if a != "\x00"], allowed=(0, 1, 2, 3))
