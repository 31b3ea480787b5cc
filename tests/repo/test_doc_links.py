"""Every relative link in README.md, docs/ and tests/gpu_kit/README.md resolves: the file exists and a
named anchor is a heading.

Pure Python, no SGLang. Links are `[text](target)` and `![alt](target)` outside fenced code blocks and
inline code; http(s) and mailto links are not checked. Anchors follow GitHub's heading slugs.
"""

import re
import unicodedata
from urllib.parse import unquote

import pytest

from tests.support import paths

ROOT = paths.REPO

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
# Inline code: a run of backticks, then anything up to the same run, not across a blank line.
CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.DOTALL)
# [text](target "title"); the text may hold one level of brackets and span lines, the target may not.
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files():
    kit = ROOT / "tests" / "gpu_kit" / "README.md"  # the GPU test machine's guide, for maintainers
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), kit]


def blank_fenced_code(text):
    """The text with every line inside (and delimiting) a fenced code block blanked; lines keep their
    numbers."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if (
                m
                and m.group(1)[0] == fence[0]
                and len(m.group(1)) >= len(fence)
                and not line.strip(fence[0] + " \t")
            ):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def blank_code_spans(text):
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def github_slug(heading):
    """GitHub's anchor for a heading: lowercase, strip, drop what is not a letter, digit, space, hyphen
    or underscore (unicode letters kept), then each space becomes a hyphen."""
    text = LINK.sub(lambda m: m.group(1), heading)  # a link in a heading contributes its text
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def heading_slugs(text):
    """The anchors of a markdown file's headings, duplicates numbered -1, -2, ... as GitHub does."""
    slugs, seen = set(), {}
    for line in blank_fenced_code(text).split("\n"):
        m = ATX_HEADING.match(line)
        if not m:
            continue
        base = github_slug(m.group(1) or "")
        n = seen.get(base, 0)
        seen[base] = n + 1
        slugs.add(base if n == 0 else f"{base}-{n}")
    return slugs


def links(text):
    """(line number, target) of every link outside code."""
    clean = blank_code_spans(blank_fenced_code(text))
    for m in LINK.finditer(clean):
        yield clean.count("\n", 0, m.start(2)) + 1, m.group(2)


def broken_links(files, root=ROOT):
    """'file:line -> target (why)' for each relative link that does not resolve."""
    slug_cache, broken = {}, []
    for path in files:
        for line, target in links(path.read_text(encoding="utf-8")):
            if not target or target.lower().startswith(EXTERNAL):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / unquote(file_part)).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{line} -> {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
                continue
            if not anchor or dest.suffix.lower() != ".md":
                continue
            if dest not in slug_cache:
                slug_cache[dest] = heading_slugs(dest.read_text(encoding="utf-8"))
            if unquote(anchor) not in slug_cache[dest]:
                broken.append(f"{where} (no heading with anchor #{anchor})")
    return broken


@pytest.mark.parametrize(
    "heading, slug",
    [
        (
            "Structured outputs, logprobs, logit processors, hidden states",
            "structured-outputs-logprobs-logit-processors-hidden-states",
        ),
        (
            "Hybrid linear-attention targets (Qwen3-Next, Qwen3.5, Qwen3.6)",
            "hybrid-linear-attention-targets-qwen3-next-qwen35-qwen36",
        ),
        ("Sampling (temperature > 0)", "sampling-temperature--0"),
        (
            "Fused kernels (`sglang_dflash/draft/fused_forward.py`)",
            "fused-kernels-sglang_dflashdraftfused_forwardpy",
        ),
        ("  Überblick: Größe  ", "überblick-größe"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_duplicate_headings_and_code_blocks():
    text = "# A\n\n## Tests\n\n```bash\n# Tests\n```\n\n## Tests\n\n### Tests\n"
    assert heading_slugs(text) == {"a", "tests", "tests-1", "tests-2"}


def test_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Real heading\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/a.md#real-heading) [ok](#top) [web](https://example.com/x.md#nope)\n"
        "[missing file](docs/b.md)\n"
        "[missing anchor](docs/a.md#no-such)\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "`[in inline code](nowhere.md)`\n"
    )
    assert broken_links([readme], root=tmp_path) == [
        "README.md:4 -> docs/b.md (no such file)",
        "README.md:5 -> docs/a.md#no-such (no heading with anchor #no-such)",
    ]


def test_doc_links_resolve():
    files = markdown_files()
    assert len(files) > 1 and sum(1 for f in files for _ in links(f.read_text(encoding="utf-8"))) > 20
    broken = broken_links(files)
    assert not broken, "broken links in README.md, docs/ or tests/gpu_kit/README.md:\n" + "\n".join(broken)


def test_docs_named_in_code_exist():
    """Module docstrings and scripts point readers to docs/*.md files; each must exist."""
    named = re.compile(r"\bdocs/[\w./-]+?\.md\b")
    sources = [*ROOT.glob("sglang_dflash/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("scripts/*.sh")]
    missing = [
        f"{path.relative_to(ROOT)} -> {name}"
        for path in [*sources, ROOT / "Makefile"]
        for name in named.findall(path.read_text())
        if not (ROOT / name).is_file()
    ]
    assert not missing, "\n".join(missing)
