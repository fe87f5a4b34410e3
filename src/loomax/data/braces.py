"""Shell-style brace expansion for data source patterns.

`shard_{0..3}.jsonl` expands to four names and `{train,extra}/*.txt` to two globs, in the
order a shell would list them. A brace group that is neither a comma list nor a numeric
range (for example `{x}`) is kept literally.
"""

import re

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Expands every brace group in `pattern`, left to right, nested groups included.

    `{a,b}` gives one string per alternative; `{0..3}` gives 0, 1, 2, 3 (descending if the
    bounds are reversed, zero-padded to the bounds' width if a bound has a leading zero,
    as in `{00..10}`). A pattern without brace groups comes back as the only element.
    """
    for open_index, char in enumerate(pattern):
        if char != "{":
            continue
        close_index = _matching_brace(pattern, open_index)
        if close_index is None:
            continue
        options = _group_options(pattern[open_index + 1 : close_index])
        if options is None:
            continue
        prefix, suffix = pattern[:open_index], pattern[close_index + 1 :]
        return [prefix + tail for option in options for tail in expand_braces(option + suffix)]
    return [pattern]


def _matching_brace(pattern: str, open_index: int) -> int | None:
    """Index of the `}` closing the `{` at `open_index`, or None if it is never closed."""
    depth = 0
    for index in range(open_index, len(pattern)):
        if pattern[index] == "{":
            depth += 1
        elif pattern[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def _group_options(body: str) -> list[str] | None:
    """The alternatives of one brace group's body, or None if it is not expandable."""
    parts = _split_top_level_commas(body)
    if len(parts) > 1:
        return parts
    match = _RANGE.match(body)
    if match is None:
        return None
    first, last = match.group(1), match.group(2)
    start, stop = int(first), int(last)
    step = 1 if stop >= start else -1
    padded = any(
        len(bound.lstrip("-")) > 1 and bound.lstrip("-")[0] == "0" for bound in (first, last)
    )
    width = max(len(first), len(last)) if padded else 0
    return [str(value).zfill(width) for value in range(start, stop + step, step)]


def _split_top_level_commas(body: str) -> list[str]:
    """Splits a brace group's body on the commas that are not inside a nested group."""
    parts, depth, current = [], 0, []
    for char in body:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        current.append(char)
    parts.append("".join(current))
    return parts
