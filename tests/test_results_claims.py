"""The numbers a reader sees are the numbers the data hold (issue 50, point 1).

Every row of the README's headline table and of docs/results.md links the JSON under docs/results/
that holds its numbers, and carries its checks in an HTML comment (invisible when rendered):

    <!-- check: x1.536 = J1.by_flash_attn.off.ratio_ours_over_llamacpp; 1.95-2.70 = rng(...); given: 0.97 -->

- `LITERAL = EXPR`: LITERAL is text of the row; EXPR is a Python expression over J1, J2, ... (the
  row's linked JSON files in the order they appear; a dict key is also an attribute) and the
  helpers below. The numbers in LITERAL (a range "a-b" or a list "a/b/c" gives several) must equal
  EXPR's value(s) rounded to the digits shown; a LITERAL without numbers asks EXPR to be true.
- `given: N N ...`: numbers of the row that are not data (a target, a setting, a version).
- Every decimal number in the row's cells other than the command and the data must be a checked
  or a given one, every linked JSON's provenance must record date, machine, commit (clean, or the
  diff's hash, or a reconstruction saying what is known of the diff) and command, and its date and
  machine must be the ones the row names.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
NUMBER = re.compile(r"(?:(?<=x)|(?<![\w.]))(\d+\.\d+(?:\.\d+)*(?:e-?\d+)?)")     # decimals: x1.5, 2.8e-7
SIGNED = re.compile(r"(?:(?<=x)|(?<![\w.,]))((?<!\d)[+-])?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e-?\d+)?)")
CHECK = re.compile(r"<!--\s*check:(.*?)-->", re.S)
LINK = re.compile(r"\]\(([^)#\s]+\.json)\)")
MACHINES = {"Intel Xeon": "Xeon", "AMD EPYC": "EPYC", "NVIDIA H200": "H200"}


class Obj(dict):
    """A JSON object whose keys are also attributes (J1.ours.decode_tokens_per_s)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _wrap(x):
    if isinstance(x, dict):
        return Obj({k: _wrap(v) for k, v in x.items()})
    return [_wrap(v) for v in x] if isinstance(x, list) else x


def wilson(k: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of k successes in n trials."""
    p, d = k / n, 1 + z * z / n
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (p + z * z / (2 * n)) / d - half, (p + z * z / (2 * n)) / d + half


def pick(rows: list, **fields):
    """The one row whose fields equal `fields` (pick(J1.forward_ms, batch=1, tokens=1))."""
    found = [r for r in rows if all(r.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, f"{len(found)} rows match {fields}"
    return found[0]


HELPERS = {"rng": lambda xs: (min(xs), max(xs)), "median": statistics.median, "mean": statistics.mean,
           "pct": lambda a, b: (a / b - 1) * 100, "wilson": wilson, "pick": pick,
           "col": lambda rows, key: [r[key] for r in rows],
           "key": lambda d, prefix: next(v for k, v in d.items() if k.startswith(prefix)),
           "min": min, "max": max, "len": len, "sum": sum, "zip": zip, "abs": abs, "all": all,
           "any": any, "sorted": sorted, "round": round, "list": list, "set": set, "int": int}


def split_cells(line: str) -> list[str]:
    """A markdown table line's cells; `\\|` inside a cell is text, not a border."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def table_rows(path: Path, header_first: str) -> list[tuple[int, list[str], list[str]]]:
    """(line number, header, cells) of each row of the table whose header starts `header_first`."""
    lines, rows, header = path.read_text().splitlines(), [], None
    for i, line in enumerate(lines, 1):
        if header is None:
            if line.startswith("| " + header_first):
                header = split_cells(line)
            continue
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append((i, header, split_cells(line)))
    return rows


def visible(text: str) -> str:
    """What a reader sees of a cell: no comments, no link targets, no inline code."""
    text = CHECK.sub(" ", re.sub(r"<!--.*?-->", " ", text, flags=re.S))
    return re.sub(r"`[^`]*`", " ", re.sub(r"\]\([^)]*\)", "]", text))


def parse_checks(row_text: str) -> tuple[list[tuple[str, str]], set[str]]:
    checks, given = [], set()
    for block in CHECK.findall(row_text):
        for item in filter(None, (s.strip() for s in block.split(";"))):
            if item.startswith("given:"):
                given.update(item[len("given:"):].split())
            else:
                literal, sep, expr = item.partition(" = ")
                assert sep, f"a check is `LITERAL = EXPR`: {item!r}"
                checks.append((literal.strip(), expr.strip()))
    return checks, given


def flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flatten(v)]
    return [value]


def literal_numbers(literal: str) -> list[tuple[float, int]]:
    """(value, digits after the point) of each number of LITERAL; "a-b" is a range, "+1.5" signed."""
    out = []
    for sign, num in SIGNED.findall(literal):
        num = num.replace(",", "")                   # 11,088
        mantissa, _, exponent = num.partition("e")
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        out.append((float(num) * (-1 if sign == "-" else 1), digits - int(exponent or 0)))
    return out


def evaluate(literal: str, expr: str, files: list) -> str | None:
    """None when LITERAL shows EXPR's value(s) rounded, else what differs."""
    env = {"__builtins__": {}, **HELPERS, **{f"J{i}": j for i, j in enumerate(files, 1)}}
    try:
        value = eval(expr, env)  # noqa: S307 - the repository's own documents
    except Exception as e:  # a wrong key path is a failed check, said with its expression
        return f"{literal!r}: {expr} raised {type(e).__name__}: {e}"
    shown = literal_numbers(literal)
    if not shown:
        return None if value is True else f"{literal!r}: {expr} is {value!r}, not true"
    values = flatten(value)
    if len(values) != len(shown):
        return f"{literal!r}: {len(shown)} numbers shown, {expr} gives {len(values)}: {values}"
    for (number, digits), v in zip(shown, values):
        if not isinstance(v, (int, float)) or abs(v - number) > 0.5 * 10 ** -digits * (1 + 1e-9) + 1e-12:
            return f"{literal!r}: {expr} = {v!r}, shown {number} ({digits} digits)"
    return None


def provenance_problems(name: str, data: dict) -> list[str]:
    p = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(p, dict):
        return [f"{name}: no provenance"]
    bad = [f"{name}: provenance.{k} missing" for k in ("date", "machine", "commit", "command") if not p.get(k)]
    commit = p.get("commit") or {}
    if not isinstance(commit, dict) or not re.fullmatch(r"[0-9a-f]{7,40}", str(commit.get("hash", ""))):
        bad.append(f"{name}: provenance.commit has no hash")
    elif commit.get("dirty") is not False and not commit.get("diff_sha256") \
            and not (p.get("reconstructed") or {}).get("diff"):
        bad.append(f"{name}: measured on a dirty tree and neither the diff's hash nor what is known of it")
    if p.get("reconstructed") is not None and not (p["reconstructed"] or {}).get("how"):
        bad.append(f"{name}: provenance.reconstructed does not say how")
    return bad


def machine_text(p: dict) -> str:
    return json.dumps(p.get("machine"))


def row_problems(doc: Path, header: list[str], cells: list[str]) -> list[str]:
    cols = dict(zip([h.lower() for h in header], cells))
    data_cell = cols.get("data", "")
    where = cols.get("date, machine") or cols.get("measured") or ""
    row_text = " | ".join(cells)
    links = LINK.findall(data_cell)
    if not links:
        return ["links no JSON in its data cell"]
    files, bad = [], []
    for link in links:
        path = (doc.parent / link).resolve()
        if not path.is_relative_to(ROOT / "docs" / "results") or not path.is_file():
            bad.append(f"{link}: not a file under docs/results/")
            continue
        data = json.loads(path.read_text())
        files.append(_wrap(data))
        bad += provenance_problems(link, data)
        p = data.get("provenance") or {}
        if str(p.get("date", ""))[:10] not in where:
            bad.append(f"{link}: measured {str(p.get('date'))[:10]}, the row says {where[:40]!r}")
        for name, mark in MACHINES.items():
            if where.count(name) and len([n for n in MACHINES if n in where]) == 1 \
                    and mark not in machine_text(p):
                bad.append(f"{link}: the row says {name}, its provenance {machine_text(p)[:60]}")
        if "AVX2" in where and '"avx2"' not in machine_text(p):
            bad.append(f"{link}: the row says AVX2, the kernel's ISA was {machine_text(p)[:80]}")
    if bad:
        return bad
    checks, given = parse_checks(row_text)
    if not checks:
        return ["has no check comment"]
    covered = set(given)
    for literal, expr in checks:
        if literal not in visible(row_text) and literal not in row_text.split("<!--")[0]:
            bad.append(f"check literal {literal!r} is not in the row's text")
        covered.update(NUMBER.findall(literal))
        bad += filter(None, [evaluate(literal, expr, files)])
    text = " ".join(visible(c) for h, c in cols.items() if h not in ("command", "data"))
    bad += [f"{n} is neither checked nor given" for n in NUMBER.findall(text)
            if n not in covered and n.split("e")[0].count(".") == 1]
    return bad


def _rows(doc: Path, header_first: str):
    rows = table_rows(doc, header_first)
    assert rows, f"{doc.name}: no table whose header starts {header_first!r}"
    return [pytest.param(doc, header, cells, id=f"{doc.name}:{line}") for line, header, cells in rows]


@pytest.mark.parametrize("doc,header,cells", _rows(RESULTS, "claim") + _rows(README, "what"))
def test_a_row_is_its_data(doc, header, cells):
    problems = row_problems(doc, header, cells)
    assert not problems, f"{cells[0][:70]!r}:\n  " + "\n  ".join(problems)


def test_the_checks_catch_a_wrong_number_a_missing_link_and_a_missing_provenance(tmp_path):
    """The rule itself fails where it should (a check that cannot fail proves nothing)."""
    files = [_wrap({"a": {"b": 2.0146, "xs": [1.95, 2.5, 2.7]}})]
    assert evaluate("x2.01", "J1.a.b", files) is None
    assert "shown 2.02" in evaluate("x2.02", "J1.a.b", files)
    assert evaluate("1.95-2.70", "rng(J1.a.xs)", files) is None
    assert evaluate("+7.2%", "pct(10.72, 10.0)", files) is None
    assert "raised" in evaluate("1.0", "J1.a.missing", files)
    assert "not true" in evaluate("identical", "1 == 2", files)
    header = ["claim", "date, machine", "command", "result", "data"]
    cells = ["c", "2026-12-06, Intel Xeon", "x", "**x2.02** <!-- check: x2.02 = J1.v -->", "none"]
    assert row_problems(RESULTS, header, cells) == ["links no JSON in its data cell"]
    assert provenance_problems("f", {"v": 1}) == ["f: no provenance"]
    dirty = {"provenance": {"date": "2026-12-06", "machine": "m", "command": "c",
                            "commit": {"hash": "abcdef1", "dirty": True}}}
    assert "dirty tree" in provenance_problems("f", dirty)[0]
    assert literal_numbers("x0.919-1.030, +1.5 / -0.4 ms") == [(0.919, 3), (1.03, 3), (1.5, 1), (-0.4, 1)]


PERF_NOTES = ROOT / "docs" / "perf-notes.md"
SECTION = re.compile(r"^#{2,3} (\d+[a-z]?(?:\.\d+)?)\.? ", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_perf_notes_contents_list_every_section_in_order_and_each_link_lands():
    """Issue 50, point 3: the table of contents names every numbered section, in order, and each
    of its links is a heading's anchor."""
    text = PERF_NOTES.read_text()
    headings = {slug(h): h for h in re.findall(r"^#{2,3} (.+)$", text, re.M)}
    numbered = SECTION.findall(text)
    contents = text[:text.index("\n## ")]
    listed = re.findall(r"\[§(\d+[a-z]?(?:\.\d+)?) [^\]]*\]\(#([^)]+)\)", contents)
    assert [n for n, _ in listed] == numbered, "the contents and the sections differ or are out of order"
    assert [a for _, a in listed if a not in headings] == []


@pytest.mark.parametrize("doc", [README, RESULTS, PERF_NOTES], ids=lambda p: p.name)
def test_no_link_leaves_the_repository(doc):
    """A relative link resolves inside the repository (a reader of a clone can follow it)."""
    outside = [t for t in re.findall(r"\]\(([^)#\s]+)", doc.read_text())
               if "://" not in t and not (doc.parent / t).resolve().is_relative_to(ROOT)]
    assert outside == []
    assert "../shared" not in doc.read_text()
