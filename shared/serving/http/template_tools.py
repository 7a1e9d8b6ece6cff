"""Which tool-call parser reads tool_choice "auto" when the node was given no
`--tool-call-parser`: the one whose format the model's chat template writes for a call.

A template shows the model its tool calls the way it was trained to write them, so the marker
the template writes for an assistant's call names the format: `<tool_call>` (Qwen2.5, Qwen3,
Hermes), `[TOOL_CALLS]` (Mistral), `<|python_tag|>` or a `"parameters"` object in a Llama 3
header layout (Llama 3.1-3.3). A template that writes none of these knows no tools: "auto" then
answers plain text, as "none" does.
"""

from __future__ import annotations

from shared.model.chat_template import ChatTemplate

# (parser, markers any of which the template's source holds); the first match wins
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|python_tag|>",)),
)
_LLAMA3_HEADER = "<|start_header_id|>"


def parser_for_template(template: ChatTemplate | None) -> str | None:
    """The parser for the calls `template` writes; None: it writes no tool calls."""
    if template is None:
        return None
    source = template.source
    for parser, markers in _MARKERS:
        if any(m in source for m in markers):
            return parser
    if _LLAMA3_HEADER in source and "parameters" in source and "tool" in source:
        return "llama3_json"
    return None
