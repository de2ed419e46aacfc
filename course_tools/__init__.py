"""The course's tooling, outside the runtime package: ``build`` (notebooks/ and colab_links.md from solutions/)
and ``run_all`` (every notebook headless, with a report). The lessons never import it; its dependencies are the
package's ``[tools]`` extra (``requirements.txt`` installs them too)."""

import importlib.util

_missing = [m for m in ("nbformat", "nbclient", "ipykernel") if importlib.util.find_spec(m) is None]
if _missing:
    raise ImportError(
        f"course_tools needs {', '.join(_missing)}: install the tooling with  pip install -e '.[tools]'  "
        "(or pip install -r requirements.txt)"
    )
