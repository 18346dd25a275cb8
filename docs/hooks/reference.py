"""mkdocs hook: render the configuration reference from the dataclasses, so each field is documented once.

`docs/reference.md` holds `<!-- fields: NAME -->` markers; each becomes a table of that class's fields (the
ones it declares itself, in order) with type, default and the `help` text that `--help` prints too.
"""

import dataclasses
import re

from transformers import TrainingArguments

from colograd.config.core import TOPICS, GRPOConfig
from colograd.config.trl_compat import trl_compat_table

# Each topic module's class, by the name its marker uses (GRPOConfig: the TrainingArguments fields it re-defaults).
CLASSES = {cls.__name__: cls for _, cls in TOPICS}
MARKER = re.compile(r"<!-- fields: (\w+) -->")
TRL_MARKER = "<!-- trl-compat -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = markdown.replace(TRL_MARKER, trl_compat_table())
    return MARKER.sub(lambda m: fields_table(CLASSES[m.group(1)]), markdown)


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
        rows.append(f"| `{f.name}` | `{_type(f.type)}` | `{default!r}` | {_cell(meaning)} |")
    return "\n".join(rows)


def _type(t: object) -> str:
    return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
