"""The harmony format gpt-oss writes its answers in, read as messages.

A message is `<|start|>{role}{header}<|message|>{body}` ended by `<|end|>`, `<|return|>`
(the answer's end) or `<|call|>` (a tool call's end); its header holds `<|channel|>{name}`
(analysis, commentary or final), maybe ` to={recipient}` (before or after the channel) and
`<|constrain|>{format}`. The chat template's generation prompt ends with
`<|start|>assistant`, so an answer starts inside its first header. The markers are special
tokens, so the answer's text must be decoded with them kept.
"""

from __future__ import annotations

from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass
class HarmonyMessage:
    channel: str
    recipient: str | None  # e.g. "functions.get_weather" for a tool call
    body: str
    complete: bool  # its end marker was seen


def harmony_header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header; `to=` may stand before or after the channel."""
    channel, recipient = "", None
    c = header.find(CHANNEL)
    if c >= 0:
        words = header[c + len(CHANNEL):].split("<|", 1)[0].split()
        channel = words[0] if words else ""
    t = header.find("to=")
    if t >= 0:
        words = header[t + 3:].split("<|", 1)[0].split()
        recipient = words[0] if words else None
    return channel, recipient


def harmony_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an answer so far. While not final, a marker that may still be being
    written is held back, as is a header without its `<|message|>`. An answer that does not
    open with a header (`<|...` or ` to=...`) is plain text: its first segment is one
    `final` message, markup and all. So the messages of a prefix of an answer are always a
    prefix of its messages (each body a prefix of the whole one's), which streaming needs."""
    if not final:
        cut = text.rfind("<")
        if cut >= 0 and "<|".startswith(text[cut:cut + 2]) and text.find("|>", cut) < 0:
            text = text[:cut]
    out = []
    for i, segment in enumerate(text.split(START)):
        if i == 0:
            head = segment.lstrip()
            header = head.startswith(("<|", "to="))
            if not header and ("<|".startswith(head) or "to=".startswith(head)):
                if final and head:  # too short to be a header after all
                    out.append(HarmonyMessage("final", None, segment, final))
                continue  # nothing yet, or too short to tell a header from text
            if not header:
                out.append(HarmonyMessage("final", None, segment, final))
                continue
        m = segment.find(MESSAGE)
        if m < 0:
            continue  # a header still being written (or a role name)
        channel, recipient = harmony_header(segment[:m])
        body = segment[m + len(MESSAGE):]
        ends = [e for e in (body.find(marker) for marker in HARMONY_ENDS) if e >= 0]
        out.append(HarmonyMessage(channel, recipient, body[:min(ends)] if ends else body, bool(ends) or final))
    return out
