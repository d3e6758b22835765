"""``python -m d3s_openrlhf.cli.flags_doc > docs/flags.md``: the ``--d3s.*`` flag reference, generated from
``D3SConfig`` (the same fields, help and defaults as ``--help``; tests/test_docs.py keeps the file equal to it)."""

from dataclasses import MISSING, fields

from d3s_openrlhf.core.config import PRESETS, D3SConfig

HEADER = """# The `--d3s.*` flags

Generated from `D3SConfig` (`d3s_openrlhf/core/config.py`) by `python -m d3s_openrlhf.cli.flags_doc > docs/flags.md`:
the same text as `--help`. Unset flags take the preset's value (`--d3s.preset`), else the default. Every value is
validated before Ray starts; a bad one is refused with the flag named.
"""


def reference() -> str:
    lines = [HEADER, "| flag | values | default | meaning |", "|---|---|---|---|"]
    for f in fields(D3SConfig):
        meta = f.metadata
        values = " \\| ".join(f"`{choice}`" for choice in meta["choices"]) if meta["choices"] else meta["type"].__name__
        default = "unset" if f.default is None or f.default is MISSING else f"`{f.default}`"
        lines.append(f"| `--d3s.{f.name}` | {values} | {default} | {meta['help']} |")
    lines += ["", "## Presets", "", "| preset | sets |", "|---|---|"]
    for name, preset in PRESETS.items():
        lines.append(f"| `{name}` | " + ", ".join(f"`{key} {value}`" for key, value in preset.items()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
