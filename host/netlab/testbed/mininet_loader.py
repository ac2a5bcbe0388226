"""Import Mininet from the Debian package into the project's virtualenv.

Debian installs Mininet (package `mininet`) for the system Python only, under
/usr/lib/python3/dist-packages. Mininet is pure Python and needs nothing but the
standard library, so instead of putting the whole system site-packages on sys.path
(which would mix Debian's numpy & co. into the venv) we load just the `mininet`
package from there. A pip-installed Mininet, when present, wins.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

DEBIAN_SITE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")


class MininetMissing(ImportError):
    pass


def load_mininet():
    """The `mininet` package (imported once); MininetMissing says how to get it."""
    if "mininet" in sys.modules:
        return sys.modules["mininet"]
    try:
        return importlib.import_module("mininet")
    except ImportError:
        pass
    for site in DEBIAN_SITE_DIRS:
        init = Path(site) / "mininet" / "__init__.py"
        if init.is_file():
            spec = importlib.util.spec_from_file_location(
                "mininet", init, submodule_search_locations=[str(init.parent)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["mininet"] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules["mininet"]
                raise
            return module
    raise MininetMissing("Mininet is not installed: apt-get install mininet "
                         "(the Debian package; `make sysdeps` does it)")
