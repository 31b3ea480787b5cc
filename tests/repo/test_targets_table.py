"""docs/targets.md's table of target classes (`scripts/targets_table.py`) against SGLang's model files:
every class SGLang can build with `set_dflash_layers_to_capture` has a status, and docs/targets.md
holds exactly the generated table. The scan is checked against the classes themselves (imported)
for two model files, and on a small tree of its own, where a new inheriting class is found."""

import importlib

import pytest

from scripts import targets_table

pytestmark = pytest.mark.sglang  # reads (and for two files imports) SGLang's model files


def test_every_sglang_class_has_a_status_and_no_status_is_stale():
    names = {c.name for c in targets_table.capturing_classes()}
    assert sorted(names - targets_table.STATUS.keys()) == [], "classes SGLang added: give each a status"
    assert sorted(targets_table.STATUS.keys() - names) == [], "statuses of classes SGLang no longer has"


def test_the_doc_holds_the_generated_table():
    generated = targets_table.table(targets_table.capturing_classes())
    assert targets_table.marked_block(targets_table.DOC.read_text()) == generated, (
        "run: python scripts/targets_table.py --write"
    )


@pytest.mark.parametrize("module", ["llama", "qwen3"])
def test_the_scan_agrees_with_the_classes(module):
    models = importlib.import_module(f"sglang.srt.models.{module}")
    entries = models.EntryClass if isinstance(models.EntryClass, list) else [models.EntryClass]
    want = {cls.__name__ for cls in entries if hasattr(cls, targets_table.METHOD)}
    got = {c.name for c in targets_table.capturing_classes() if c.module == module}
    assert got == want and want


def test_the_scan_follows_inheritance_across_files(tmp_path):
    (tmp_path / "base.py").write_text(
        "class Base:\n    def set_dflash_layers_to_capture(self, ids):\n        pass\n\nEntryClass = [Base]\n"
    )
    child = "from base import Base\nclass Child(Base):\n    pass\nclass Other:\n    pass\n"
    (tmp_path / "child.py").write_text(child + "EntryClass = [Child, Other]\n")
    found = targets_table.capturing_classes(tmp_path)
    assert [(c.name, c.module, c.defines) for c in found] == [
        ("Base", "base", "Base"),
        ("Child", "child", "Base"),
    ]
    with pytest.raises(KeyError):  # classes without a status fail the table
        targets_table.table(found)


def test_the_classes_served_beyond_the_builtin_are_those_the_plugin_hooks():
    """The rows whose class has no DFlash capture of its own: "CPU-tested, beyond the built-in"
    exactly where `target_capture` gives one, and the others refused by it at start-up."""
    from sglang_dflash.draft import target_capture

    classes = [c for c in targets_table.capturing_classes() if c.hook != "DFlash"]
    served = {c.name for c in classes if targets_table.STATUS[c.name][0] == "plugin"}
    assert served == target_capture.THROUGH_EAGLE3 | target_capture.RESIDUAL_STREAM
    for c in classes:
        if targets_table.STATUS[c.name][0] == "no-capture":
            assert target_capture.refusal(type(c.name, (), {}), False) is not None, c.name
