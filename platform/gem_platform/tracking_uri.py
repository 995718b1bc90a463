"""The MLflow store a command uses, and the checks that refuse an unusable one in seconds with
a TrackingError naming it (credentials masked), before any run or client exists: a URI that
does not parse, a scheme MLflow has no store for, a missing folder, a database whose driver
is not installed, a server or database host that does not answer.

Importing this module loads neither MLflow nor SQLAlchemy: only a database URI loads
SQLAlchemy, to ask it which driver the URI needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from gem_platform.errors import TrackingError
from gem_platform.net import default_port, parse_url, redact, require_reachable

DEFAULT_DB = "mlflow.db"
URI_FIX = ("Use http://HOST:PORT (an MLflow server), sqlite:///FILE, or a database URI such as "
           "postgresql://USER@HOST:5432/DB; or unset tracking.uri / MLFLOW_TRACKING_URI to use "
           "./mlflow.db.")
# Schemes MLflow has a tracking store for ('' and file: a local folder).
MLFLOW_SCHEMES = {"", "file", "databricks", "databricks-uc", "uc", "http", "https",
                  "postgresql", "mysql", "sqlite", "mssql"}
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
# Driver module -> what to install (SQLAlchemy's default drivers first).
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary",
                   "MySQLdb": "mysqlclient", "pymysql": "pymysql", "pyodbc": "pyodbc",
                   "pg8000": "pg8000", "pymssql": "pymssql"}


def resolve_tracking_uri(configured: str | None) -> str:
    """Recipe value, else MLFLOW_TRACKING_URI, else a sqlite store in the working directory."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"sqlite:///{Path.cwd() / DEFAULT_DB}"
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """Fail fast (seconds, not minutes of retries) when the store can't be used."""
    parsed = parse_url(uri, "MLflow tracking URI", URI_FIX, TrackingError)
    scheme = parsed.scheme.lower().split("+")[0]
    if not scheme and "://" in uri:
        raise TrackingError(f"MLflow tracking URI {redact(uri)[:200]!r} has no scheme before "
                            "'://'.", URI_FIX)
    if scheme not in MLFLOW_SCHEMES:
        raise TrackingError(f"MLflow has no tracking store for {parsed.scheme}:// "
                            f"({redact(uri)[:200]}).", URI_FIX)
    if scheme in ("http", "https"):
        if not parsed.hostname:
            raise TrackingError(f"MLflow tracking URI {redact(uri)} has no valid host:port.",
                                "Use http://HOST:PORT, e.g. http://127.0.0.1:5000.")
        require_reachable(
            parsed.hostname, default_port(parsed), f"MLflow tracking server {redact(uri)}",
            "Start it (e.g. `mlflow server --host 127.0.0.1 --port 5000`), fix "
            "tracking.uri / MLFLOW_TRACKING_URI, or unset them to use ./mlflow.db.",
            TrackingError, timeout)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme in DATABASE_PORTS:
        _check_database(uri, scheme, timeout)


def _check_sqlite(uri: str) -> None:
    db = sqlite_path(uri)
    try:
        folder_ok = db is not None and db.parent.is_dir()
        is_dir = db is not None and db.is_dir()
    except (OSError, ValueError) as err:  # a name too long for the filesystem, a NUL
        raise TrackingError(f"MLflow store {redact(uri)[:200]} is not a usable path ({err}).",
                            "Point tracking.uri at a file, e.g. sqlite:///mlflow.db.") from None
    if not folder_ok:
        where = db.parent if db is not None else uri
        raise TrackingError(f"MLflow store {redact(uri)}: folder {where} does not exist.",
                            "Create the folder or point tracking.uri elsewhere.")
    if is_dir:
        raise TrackingError(f"MLflow store {redact(uri)} is a directory, not a database.",
                            "Point tracking.uri at a file, e.g. sqlite:///mlflow.db.")


def _check_database(uri: str, scheme: str, timeout: float) -> None:
    """The driver SQLAlchemy would load for ``uri`` is installed, and its host answers."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as err:
        raise TrackingError(f"MLflow store {redact(uri)[:200]} is not a database URI "
                            f"SQLAlchemy can use ({redact(str(err))[:200]}).", URI_FIX) from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = (err.name or str(err)).split(".")[0]
        package = DRIVER_PACKAGES.get(module, module)
        raise TrackingError(
            f"MLflow store {redact(uri)[:200]} needs the {scheme} driver '{module}', which is "
            "not installed here.",
            f"Install it (pip install '{package}'), or use an MLflow server (http://HOST:PORT) "
            "or sqlite:///FILE.") from None
    host = url.host or "localhost"
    require_reachable(host, url.port or DATABASE_PORTS[scheme],
                      f"MLflow store {redact(uri)[:200]}: the database at {host}",
                      "Check the host, port and that the database runs, or point tracking.uri "
                      "elsewhere.", TrackingError, timeout)
