"""Reading YAML (or JSON) that comes from outside the agent, within limits.

Everything the agent reads from a file someone else wrote — a sharing config, a MIG layout file, a node
spec — goes through ``agent.config.bounded.read_bounded`` (the bytes) and :func:`load_yaml` (the document).
Either raises ``ConfigError(origin, [problem])`` whose problem names the limit that was broken and the fix;
nothing else escapes, whatever the input: no ``RecursionError``, no ``MemoryError``, no parser exception of
another kind.

The limits, far above any real document (the catalogue's deepest config nests 7 levels and holds 35
values; the shipped layouts file 5 levels and 60 values):

- ``MAX_BYTES`` (1 MiB): a ConfigMap holds at most 1 MiB in all. A bigger file is refused from its size,
  without being read; a FIFO, a socket or a device other than ``/dev/null`` is refused without being opened.
- text only: UTF-8 (a UTF-8 byte-order mark is allowed), no control characters (YAML forbids them).
- ``MAX_DEPTH`` (64): collections inside collections. PyYAML composes recursively, so 500 ``[`` raise
  ``RecursionError``; the depth is counted before a level is composed, so nothing deeper is ever built.
- ``MAX_NODES`` (20,000): values, with every alias counted as the size of what it repeats. PyYAML shares
  an aliased value instead of copying it, but anything that walks the result (validation, a dump) sees
  each repetition: nine aliases of nine aliases of ... ("billion laughs") is 9^n values from a few hundred
  bytes, and is refused as soon as the count passes the limit.
- ``MAX_ALIASES`` (1,000) alias references; an alias to the collection it is in (a cycle) is refused.
- ``MAX_INT_DIGITS`` (4,300, Python's bound on an int read from text): a longer integer is refused where it is
  written. YAML's hex, octal and binary integers escape that bound when they are read, and a number past it cannot
  be printed in any message. (A shorter one reaches the field, which names its own bound: ``dra.defaultShare: a
  number of about 4000 digits is too large...``.)
- one document: a second non-empty document (after ``---``) is an error. NVIDIA's plugin silently reads
  only the first one, so a second config in the same file would be ignored without a word.

Text that is not YAML is a :class:`YamlSyntaxError`: ``file:line:column: not valid YAML or JSON: ...`` with
the offending line and a caret (``excerpt``), never PyYAML's ``in "<unicode string>"``.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, StreamEndEvent
from yaml.nodes import Node, ScalarNode
from yaml.resolver import Resolver

from agent.config.bounded import MAX_BYTES, too_big
from agent.config.model import ConfigError

MAX_DEPTH = 64
MAX_NODES = 20_000
MAX_ALIASES = 1_000
MAX_INT_DIGITS = 4300  # Python's default bound on an int read from or written as text (sys.int_info)
_INT_BOUND = 10**MAX_INT_DIGITS
_EXCERPT_WIDTH = 100  # characters of the offending line shown under a syntax error
# libyaml 0.2.6 (in PyYAML's wheels from 6.0.4) refuses more than 1,000 nested levels while it scans ahead, before
# a collection reaches the composer: "exceeded maximum nesting depth" (yaml_set_max_nest_level's default)
LIBYAML_MAX_NESTING = 1000
_DEPTH_SCAN_EVENTS = 10_000  # after the depth limit, how far to read on to say how deep it really goes

_NULL_TAG = "tag:yaml.org,2002:null"
_NON_PRINTABLE = yaml.reader.Reader.NON_PRINTABLE  # what YAML forbids in a stream: NUL, other C0/C1 controls...


class _LimitBroken(Exception):
    """Raised inside the loader; load_yaml turns it into a ConfigError."""


def decode_text(data: bytes | str, origin: str, *, kind: str = "a config") -> str:
    """UTF-8 text (a leading byte-order mark dropped), or ConfigError naming the first bad byte."""
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            origin, [f"not UTF-8 text (byte {error.start}); {kind} is UTF-8 text: is this a binary file?"]
        ) from error


def load_yaml(
    data: bytes | str,
    origin: str,
    *,
    kind: str = "a config",
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
    max_aliases: int = MAX_ALIASES,
) -> Any:
    """The one YAML (or JSON) document in ``data``, built with PyYAML's safe constructors.

    An empty document (or one holding only comments) is ``None``. Raises ``ConfigError(origin, [problem])``
    and nothing else; ``kind`` ("a sharing config", "a MIG layout file"...) names the document in messages.
    """
    if len(data) > max_bytes:
        raise ConfigError(origin, [too_big(len(data), max_bytes)])
    text = decode_text(data, origin, kind=kind)
    bad = _NON_PRINTABLE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise ConfigError(
            origin,
            [
                f"not text: character U+{ord(bad.group()):04X} (not allowed in YAML) at line {line}, column {column}; "
                f"{kind} is YAML or JSON text: is this a binary file?"
            ],
        )
    if isinstance(data, str) and len(text.encode("utf-8")) > max_bytes:
        raise ConfigError(origin, [too_big(len(text.encode("utf-8")), max_bytes)])
    loader = _BoundedLoader(text, kind=kind, max_depth=max_depth, max_nodes=max_nodes, max_aliases=max_aliases)
    try:
        return loader.load_one()
    except _LimitBroken as error:
        raise ConfigError(origin, [str(error)]) from None
    except yaml.MarkedYAMLError as error:
        if "maximum nesting depth" in str(error.problem):  # libyaml's own limit, met while it scans ahead
            raise ConfigError(
                origin,
                [
                    f"nested at least {LIBYAML_MAX_NESTING + 1:,} levels deep (YAML's parser stops at "
                    f"{LIBYAML_MAX_NESTING:,}, at {_where(error.problem_mark)}); {kind} nests at most {max_depth} "
                    "levels: flatten it"
                ],
            ) from None
        raise _syntax_error(origin, text, error) from None
    except yaml.YAMLError as error:
        raise ConfigError(origin, [f"not valid YAML or JSON: {_without_stream_name(str(error))}"]) from None
    except RecursionError:
        raise ConfigError(
            origin, [f"nested too deeply to read; {kind} nests at most {max_depth} levels: flatten it"]
        ) from None
    except Exception as error:  # a value PyYAML cannot build (a 5,000-digit int, 2024-13-45...): still bad input
        raise ConfigError(
            origin, [f"not valid YAML or JSON: a value cannot be read: {type(error).__name__}: {_one_line(str(error))}"]
        ) from None
    finally:
        loader.dispose()


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "an unknown place"


def _without_stream_name(text: str) -> str:
    """PyYAML's own text names the stream ``in "<unicode string>", line 3``: no user knows that file."""
    return _one_line(re.sub(r'\s*in "<[^>]*>"(, line \d+, column \d+|, position \d+)?:?', "", text))


def _shown_line(text: str, line: int, column: int, context_at: tuple[int, int] | None) -> tuple[int, str, int] | None:
    """The line an excerpt shows: the problem's; when that is blank (the end of the text), the line where the
    unfinished construct began, else the last line with something on it. (number, text, caret column)."""
    lines = text.splitlines()

    def at(number: int) -> str:
        return lines[number - 1] if 0 < number <= len(lines) else ""

    if at(line).strip():
        return line, at(line), column
    if context_at is not None and at(context_at[0]).strip():
        return context_at[0], at(context_at[0]), context_at[1]
    previous = next((n for n in range(min(line, len(lines)), 0, -1) if at(n).strip()), None)
    return (previous, at(previous), len(at(previous)) + 1) if previous else None


def _syntax_error(origin: str, text: str, error: yaml.MarkedYAMLError) -> ConfigError:
    problem, mark = error.problem, error.problem_mark
    context, context_mark = error.context, error.context_mark
    if not problem or mark is None:  # only a context (or nothing): it is the problem then
        problem, mark, context, context_mark = problem or context, mark or context_mark, None, None
    if mark is None:
        return ConfigError(origin, [f"not valid YAML or JSON: {_without_stream_name(problem or str(error))}"])
    line, column = mark.line + 1, mark.column + 1
    context_at = (context_mark.line + 1, context_mark.column + 1) if context_mark is not None else None
    return YamlSyntaxError(
        origin,
        _one_line(problem or "not valid"),
        (line, column),
        _shown_line(text, line, column, context_at),
        context=_one_line(context) if context else None,
        context_at=context_at,
    )


class YamlSyntaxError(ConfigError):
    """The text is not YAML: where (1-based line and column), what, and the offending line.

    ``str()`` is ``file:line:column: not valid YAML or JSON: <problem>`` (what compilers print and editors
    jump to); ``problems`` hold the problem as one line, for the verdict lists of ``tessera validate``;
    ``excerpt`` is the offending line with a caret under the column (when the problem is at the end of the
    text: the line where the unfinished construct began), for a person to read under the message.
    """

    def __init__(
        self,
        origin: str,
        problem: str,
        at: tuple[int, int],
        shown: tuple[int, str, int] | None,
        *,
        context: str | None = None,
        context_at: tuple[int, int] | None = None,
        note: str = "",
    ) -> None:
        self.line, self.column = at
        self.problem, self.context, self.context_at, self.shown, self.note = problem, context, context_at, shown, note
        within = ""
        if context:
            within = f" ({context}" + (f" at line {context_at[0]}, column {context_at[1]})" if context_at else ")")
        suffix = f" ({note})" if note else ""
        where = f" at line {self.line}, column {self.column}"
        super().__init__(origin, [f"not valid YAML or JSON: {problem}{where}{within}{suffix}"])
        self.args = (f"{origin}:{self.line}:{self.column}: not valid YAML or JSON: {problem}{within}{suffix}",)

    @property
    def excerpt(self) -> tuple[str, ...]:
        """``  3 | sharing: [`` and a caret line under it; empty when there is no line to show."""
        if self.shown is None:
            return ()
        number, text, column = self.shown
        if len(text) > _EXCERPT_WIDTH:  # a window around the column, marked as cut where it is
            start = max(0, min(column - 1 - _EXCERPT_WIDTH // 2, len(text) - _EXCERPT_WIDTH))
            text = (
                ("…" if start else "")
                + text[start : start + _EXCERPT_WIDTH]
                + ("…" if start + _EXCERPT_WIDTH < len(text) else "")
            )
            column = column - start + (1 if start else 0)
        gutter = " " * len(str(number))
        under = "".join("\t" if c == "\t" else " " for c in text[: column - 1]).ljust(column - 1)
        return (f"  {number} | {text}", f"  {gutter} | {under}^")

    def moved(self, origin: str, line_offset: int, indent: int, note: str) -> YamlSyntaxError:
        """The same error in the file around the text: the text began ``line_offset`` lines down and ``indent``
        columns in (a literal block scalar ``key: |`` of a ConfigMap manifest)."""
        shown = None
        if self.shown is not None:
            number, text, column = self.shown
            shown = (number + line_offset, " " * indent + text, column + indent)
        context_at = (self.context_at[0] + line_offset, self.context_at[1] + indent) if self.context_at else None
        return YamlSyntaxError(
            origin,
            self.problem,
            (self.line + line_offset, self.column + indent),
            shown,
            context=self.context,
            context_at=context_at,
            note=note,
        )


try:  # libyaml's parser (bundled with PyYAML's wheels): the same events, a hundred times faster on a bomb
    from yaml._yaml import CParser

    _PARSER: tuple[type, ...] = (CParser,)

    def _init_parser(loader: Any, text: str) -> None:
        CParser.__init__(loader, text)

except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    _PARSER = (Reader, Scanner, Parser)

    def _init_parser(loader: Any, text: str) -> None:
        Reader.__init__(loader, text)
        Scanner.__init__(loader)
        Parser.__init__(loader)


class _BoundedLoader(Composer, *_PARSER, SafeConstructor, Resolver):  # type: ignore[misc]
    """PyYAML's safe loader whose (Python) composer counts depth, values and aliases, before anything is built.

    The events come from libyaml when PyYAML has it (from PyYAML's pure-Python parser otherwise); the
    composer is always PyYAML's own, so that the depth is counted before a level is composed.
    """

    def __init__(self, text: str, *, kind: str, max_depth: int, max_nodes: int, max_aliases: int) -> None:
        _init_parser(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._kind = kind
        self._max_depth, self._max_nodes, self._max_aliases = max_depth, max_nodes, max_aliases
        self._depth = 0
        self._count = 0  # values composed, each alias counted as the size of what it repeats
        self._aliases = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its size, once it is complete
        self._keep: list[Node] = []  # the anchored nodes, so that their ids stay theirs

    def load_one(self) -> Any:
        self.get_event()  # STREAM-START
        document: Node | None = None
        while not self.check_event(StreamEndEvent):
            start = self.peek_event().start_mark
            node = self.compose_document()
            if isinstance(node, ScalarNode) and node.tag == _NULL_TAG:
                continue  # an empty document (only comments, or a bare '---'): nothing in it
            if document is not None:
                raise _LimitBroken(
                    f"holds more than one YAML document (another starts at {_where(start)}); {self._kind} is "
                    "one document: remove the '---' line, or put each config under its own ConfigMap key"
                )
            document = node
        self.get_event()  # STREAM-END
        return None if document is None else self.construct_document(document)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """A value PyYAML cannot build (a 5,000-digit int, 2024-13-45...) is bad input at the value's place."""
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:
            raise yaml.constructor.ConstructorError(
                None, None, f"a value cannot be read: {type(error).__name__}: {_one_line(str(error))}", node.start_mark
            ) from None

    def _construct_int(self, node: ScalarNode) -> int:
        """An integer of at most ``MAX_INT_DIGITS`` digits. YAML's hex, octal and binary integers are not held to
        Python's 4,300-digit limit for text, so a 1 MiB document could hold an int that no message could print."""
        value: int = SafeConstructor.construct_yaml_int(self, node)
        if abs(value) >= _INT_BOUND:
            raise yaml.constructor.ConstructorError(
                None, None, f"a number of more than {MAX_INT_DIGITS:,} digits: no setting takes one", node.start_mark
            )
        return value

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            return self._alias(parent, index)
        event = self.peek_event()
        collection = isinstance(event, CollectionStartEvent)
        if collection and self._depth >= self._max_depth:
            self._too_deep(event.start_mark)
        before = self._count
        self._count += 1
        if self._count > self._max_nodes:
            raise _LimitBroken(
                f"more than {self._max_nodes:,} values (at {_where(event.start_mark)}); {self._kind} has a few "
                "hundred at most: this is not a config, or it repeats itself: shorten it"
            )
        self._depth += collection
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= collection
        if event.anchor is not None:
            self._sizes[id(node)] = self._count - before
            self._keep.append(node)
        return node

    def _alias(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        target = self.anchors.get(event.anchor)
        if target is not None:  # an undefined alias is PyYAML's error, below
            self._aliases += 1
            if self._aliases > self._max_aliases:
                raise _LimitBroken(
                    f"more than {self._max_aliases:,} aliases (*{event.anchor} at {_where(event.start_mark)}); "
                    f"{self._kind} may use at most {self._max_aliases:,}: write the values out"
                )
            size = self._sizes.get(id(target))
            if size is None:
                raise _LimitBroken(
                    f"alias *{event.anchor} at {_where(event.start_mark)} is inside the value it repeats (a "
                    "cycle); remove the alias"
                )
            self._count += size
            if self._count > self._max_nodes:
                raise _LimitBroken(
                    f"aliases expand to more than {self._max_nodes:,} values (*{event.anchor} at "
                    f'{_where(event.start_mark)}): an alias bomb ("billion laughs"); {self._kind} may expand '
                    f"to at most {self._max_nodes:,}: write the values out or use fewer aliases"
                )
        return super().compose_node(parent, index)

    def _too_deep(self, mark: yaml.Mark) -> None:
        """Read on (a bounded number of events, without building anything) to say how deep it goes."""
        depth = deepest = self._depth
        exact = False
        try:
            for _ in range(_DEPTH_SCAN_EVENTS):
                event = self.get_event()
                if event is None or isinstance(event, StreamEndEvent):
                    break
                if isinstance(event, CollectionStartEvent):
                    depth += 1
                    deepest = max(deepest, depth)
                elif isinstance(event, CollectionEndEvent):
                    depth -= 1
                    if depth <= self._depth:
                        exact = True
                        break
        except Exception:  # noqa: S110 - a syntax error further on: the depth so far is the answer
            pass
        how_deep = f"{deepest}" if exact else f"at least {deepest}"
        raise _LimitBroken(
            f"nested {how_deep} levels deep (level {self._max_depth + 1} at {_where(mark)}); {self._kind} nests "
            f"at most {self._max_depth} levels: flatten it"
        )


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader._construct_int)
