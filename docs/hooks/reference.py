"""The configuration reference, rendered from the dataclasses, so each field is documented once.

`docs/reference.md` holds `<!-- fields: NAME -->` markers, each followed by that class's table (the fields it
declares itself, in order, with type, default and the `help` text that `--help` prints too) up to
`<!-- end fields -->`; docs/porting-trl.md's `<!-- trl-compat -->` is followed by the TRL-port table up to
`<!-- end trl-compat -->`. The
tables are in the repository, so the page reads complete in a checkout: `make reference` (this file run as a
script) writes them, tests/config/test_config.py fails while they are stale, and as an mkdocs hook it renders
them again when the site is built.
"""

import dataclasses
import re
import sys
from pathlib import Path

from transformers import TrainingArguments

from colograd.config.core import TOPICS, GRPOConfig
from colograd.config.trl_compat import trl_compat_table

# Each topic module's class, by the name its marker uses (GRPOConfig: the TrainingArguments fields it re-defaults).
CLASSES = {cls.__name__: cls for _, cls in TOPICS}
FIELDS = re.compile(r"(<!-- fields: (\w+) -->\n)(?:.*?<!-- end fields -->\n)?", re.DOTALL)
TRL = re.compile(r"(<!-- trl-compat -->\n)(?:.*?<!-- end trl-compat -->\n)?", re.DOTALL)
# The pages with markers.
PAGES = [Path(__file__).resolve().parents[1] / name for name in ("reference.md", "porting-trl.md")]


def render(markdown: str) -> str:
    """`markdown` with every marker's table written (or rewritten) after it."""
    markdown = TRL.sub(lambda m: f"{m.group(1)}{trl_compat_table()}\n<!-- end trl-compat -->\n", markdown)
    return FIELDS.sub(lambda m: f"{m.group(1)}{fields_table(CLASSES[m.group(2)])}\n<!-- end fields -->\n", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return render(markdown)


def fields_table(cls: type) -> str:
    """A Markdown table of the fields `cls` declares (inherited TrainingArguments fields are not repeated)."""
    own = cls.__annotations__
    rows = ["| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name not in own:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        inherited = cls is GRPOConfig and f.name in TrainingArguments.__dataclass_fields__
        meaning = f.metadata.get("help", "") + (" (TrainingArguments' field, another default.)" if inherited else "")
        # The annotation, not `f.type`: transformers' argument parser rewrites a field's type in place (an Optional
        # becomes its inner type), so `f.type` depends on what ran before in the process.
        rows.append(f"| `{f.name}` | `{_type(own[f.name])}` | `{default!r}` | {_cell(meaning)} |")
    return "\n".join(rows)


def _type(t: object) -> str:
    return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    for page in PAGES:
        page.write_text(render(page.read_text()))
        print(f"wrote {page}", file=sys.stderr)
