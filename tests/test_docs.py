"""The documentation stays true: links resolve, the flag reference is what the config generates, and the README's
two set-up commands are the ones CI and the demo run."""

import re
from pathlib import Path

import pytest

from d3s_openrlhf.cli import flags_doc

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_relative_link_resolves(page):
    text = page.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}
            if anchor not in slugs:
                broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_the_flag_reference_is_what_the_config_generates():
    assert (ROOT / "docs" / "flags.md").read_text() == flags_doc.reference(), (
        "docs/flags.md is stale: python -m d3s_openrlhf.cli.flags_doc > docs/flags.md"
    )


def setup_commands():
    """The commands of the README's set-up block (comments dropped)."""
    block = re.search(r"## Try it on a CPU.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block, "the README has no set-up block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_set_up_commands_are_the_ones_ci_and_the_demo_run():
    tests, demo = setup_commands()
    assert tests == "bash tests/run.sh"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == tests  # CI runs the README's test command, nothing more
    assert "bash examples/cpu/setup_env.sh" in (ROOT / "tests" / "run.sh").read_text()  # the same environment
    assert demo == "bash examples/cpu/setup_env.sh && .venv/bin/python -m d3s_openrlhf.cli.demo --out demo_out"
    # the demo test runs the same entrypoint (d3s_openrlhf.cli.demo's main) on a task module
    assert 'demo.main(["--out"' in (ROOT / "tests" / "cli" / "test_cli_demo.py").read_text()


def test_the_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "d3s_openrlhf.cli.train_ppo_ray" in text.split("## Try it on a CPU")[0]  # the one-line change, early
    assert not re.search(r"\d+ min(utes)? \d+ s|suite (time|takes)", text)  # no suite times in prose


def test_the_architecture_page_names_every_module_once():
    """docs/architecture.md's module table: one row per module of the package, no module missing, none twice."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+\.py)` \|", table, re.MULTILINE)
    package = ROOT / "d3s_openrlhf"
    modules = sorted(path.relative_to(package).as_posix() for path in package.rglob("*.py"))
    assert sorted(set(rows)) == modules, (
        f"missing: {sorted(set(modules) - set(rows))}, not in the package: {sorted(set(rows) - set(modules))}"
    )
    assert len(rows) == len(set(rows)), f"named twice: {sorted({row for row in rows if rows.count(row) > 1})}"
