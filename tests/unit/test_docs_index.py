"""docs/architecture.md and the README's ADR index say what is there: every module, every layer
the tests enforce with what it may import, every decision record."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "dsh_mesh"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
EXPORTS_TEST = ROOT / "tests" / "unit" / "test_exports.py"

# A module named in a table cell as `pkg/_module.py` (or `pkg/sub/name.py`).
MODULE_SPAN = re.compile(r"`([a-z_]+(?:/[A-Za-z0-9_]+)+\.py)`")
# A layer's name among the cell's words (`_proto` included).
WORD = re.compile(r"[A-Za-z_]+")
# A class's member in a code span, as the walks name each hop: `Deliveries._route`.
MEMBER_SPAN = re.compile(r"`([A-Z][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")


def library_modules() -> set[str]:
    """Every Python module of the package as `pkg/name.py`: generated code and package
    ``__init__`` files aside (a package is named by its heading, not by a row)."""
    found = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        relative = path.relative_to(PACKAGE_DIR)
        if relative.parts[0] == "_proto" or path.name == "__init__.py":
            continue
        found.add(relative.as_posix())
    return found


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row, header and rule rows included."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def modules_in_tables(text: str) -> set[str]:
    """The modules named in the first cell of a table row."""
    return {name for cells in table_rows(text) for name in MODULE_SPAN.findall(cells[0])}


def section(text: str, title: str) -> str:
    """The text of the ``## title`` section of ``text``."""
    assert f"\n## {title}\n" in text, f"no section '## {title}'"
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def allowed_imports() -> dict[str, set[str]]:
    """`ALLOWED` of tests/unit/test_exports.py, read as the literal it is (test modules do not
    import one another)."""
    tree = ast.parse(EXPORTS_TEST.read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "ALLOWED"
            and node.value is not None
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise AssertionError("tests/unit/test_exports.py defines no ALLOWED")


def layer_table(text: str) -> dict[str, str]:
    """The layer table of `## Layers`: each layer of a row's first cell to its "may import" cell."""
    table: dict[str, str] = {}
    for cells in table_rows(section(text, "Layers")):
        for layer in re.findall(r"`([a-z_]+)`", cells[0]):
            table[layer] = cells[1]
    return table


def layers_named(cell: str, layers: set[str]) -> set[str]:
    """The layers a "may import" cell names, remarks in parentheses aside (they say what a
    layer may not import, or why)."""
    plain = re.sub(r"\([^)]*\)", "", cell)
    return {word for word in WORD.findall(plain) if word in layers}


def class_members() -> dict[str, set[str]]:
    """Every class of the package (and every gRPC service of proto/) to the names it defines:
    methods, class attributes and fields, and what its methods assign to ``self``."""
    members: dict[str, set[str]] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if path.relative_to(PACKAGE_DIR).parts[0] == "_proto":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif (
                    isinstance(item, ast.Attribute)
                    and isinstance(item.ctx, ast.Store)
                    and isinstance(item.value, ast.Name)
                    and item.value.id == "self"
                ):
                    names.add(item.attr)
    for proto in (ROOT / "proto").rglob("*.proto"):
        for service, body in re.findall(
            r"^service (\w+) \{(.*?)^\}", proto.read_text(), re.M | re.S
        ):
            members.setdefault(service, set()).update(re.findall(r"^\s*rpc (\w+)\(", body, re.M))
    return members


def unknown_members(text: str, members: dict[str, set[str]]) -> list[str]:
    """The `Class.member` spans of ``text`` that name no class, or no member of it."""
    return sorted(
        f"{cls}.{name}"
        for cls, name in set(MEMBER_SPAN.findall(text))
        if name not in members.get(cls, set())
    )


def test_the_module_walk_sees_every_layer_and_names_modules_as_the_doc_does() -> None:
    modules = library_modules()
    assert {"agent/_agent.py", "runtime/_manager.py", "ui/_app.py", "node/__main__.py"} <= modules
    assert not any(name.startswith("_proto/") or name.endswith("__init__.py") for name in modules)
    assert modules_in_tables("| `a/_b.py`, `a/c.py` | x |\n| y | `d/_e.py` |") == {
        "a/_b.py",
        "a/c.py",
    }


def test_every_module_has_a_row_in_the_architecture() -> None:
    listed = modules_in_tables(ARCHITECTURE.read_text(encoding="utf-8"))
    assert sorted(library_modules() - listed) == []


def test_every_module_the_architecture_names_exists() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    packages = {path.name for path in PACKAGE_DIR.iterdir() if path.is_dir()}
    named = {name for name in MODULE_SPAN.findall(text) if name.split("/")[0] in packages}
    assert "runtime/_manager.py" in named
    assert sorted(named - library_modules()) == []


def test_the_member_check_knows_classes_fields_and_services() -> None:
    members = class_members()
    assert {"_route", "deliver"} <= members["Deliveries"]
    assert "client" in members["Caller"]  # a dataclass field
    assert "ResolveApproval" in members["MeshControl"]  # a service of proto/
    text = "`Deliveries._route` `MeshControl.ResolveApproval` `Deliveries._gone` `Nobody.x`"
    assert unknown_members(text, members) == ["Deliveries._gone", "Nobody.x"]


def test_every_method_the_architecture_walks_through_exists() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert unknown_members(text, class_members()) == []


def test_the_architecture_walks_a_message_and_an_approval_decision() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for title in ("One message's path", "One approval decision's path"):
        walk = section(text, title)
        hops = set(MEMBER_SPAN.findall(walk))
        assert len(hops) >= 20, f"{title}: {len(hops)} hops named"
    decision = section(text, "One approval decision's path")
    for hop in (
        "ui/_app.py",
        "client/_client.py",
        "transport/_control.py",
        "runtime/_delivery.py",
        "runtime/_acceptance.py",
        "agent/_agent.py",
    ):
        assert f"`{hop}`" in decision, hop


def test_the_layer_check_reads_what_a_cell_names() -> None:
    layers = {"core", "runtime", "node", "_proto", "client"}
    assert layers_named("core, `_proto` (not runtime, not node)", layers) == {"core", "_proto"}
    assert layers_named("nothing of `dsh_mesh`: a leaf", layers) == set()


def test_every_layer_the_tests_enforce_has_a_row_saying_what_it_may_import() -> None:
    allowed = allowed_imports()
    assert {"core", "agent", "runtime", "mcp", "ui", "cli"} <= set(allowed)
    table = layer_table(ARCHITECTURE.read_text(encoding="utf-8"))
    assert sorted(set(allowed) - set(table)) == []
    every_layer = set(allowed) | {"_proto", "testing", "demo"}
    for layer, may_import in allowed.items():
        named = layers_named(table[layer], every_layer)
        assert named == may_import - {layer}, f"the `{layer}` row says {table[layer]!r}"


def test_the_readme_links_every_decision_record() -> None:
    adr = ROOT / "docs" / "adr"
    records = sorted(path.name for path in adr.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert len(records) >= 41
    linked = set(re.findall(r"\]\(docs/adr/([0-9]{4}-[^)]+\.md)\)", README.read_text("utf-8")))
    assert [name for name in records if name not in linked] == []
    assert sorted(linked - set(records)) == []
