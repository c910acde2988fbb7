"""One ``--help`` style for every command: defaults shown once, examples kept as written.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: None)`` to options without a
default and a second default to help texts that already say theirs; this one appends the
default only when there is one worth reading and the help does not mention it already. In a
description, paragraphs are wrapped to the terminal and indented lines (a command to paste)
are left as they are.
"""

from __future__ import annotations

import argparse
import textwrap


class DefaultsHelp(argparse.HelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if any(line.startswith(" ") for line in para.splitlines()):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(para.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
