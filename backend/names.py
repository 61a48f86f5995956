"""Names from open sets: a device, a weight format, a drafter kind.

Knows: how such a name behaves (like a str Enum member: one object per name, compared with `is`,
`.value` is the name, pickles to itself) while staying open, so that whoever adds a device, a
format or a drafter kind declares its name where it lives (devices/<name>/, draft_kinds/*.py) and
edits nothing here or in the enums' modules. Does not know: which names exist.
"""
from __future__ import annotations


class Name(str):
    """A subclass is one open set. `strict`: only registered names (`register`) are valid, any
    other raises ValueError (DrafterKind: a request naming an unknown drafter); else any non-empty
    string is a name and is checked where it meets its registry (devices.backend_for)."""

    strict = False
    _interned: dict

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._interned = {}

    def __new__(cls, value):
        if isinstance(value, cls):
            return value
        got = cls._interned.get(str.__str__(value)) if isinstance(value, str) else None
        if got is not None:
            return got
        if cls.strict or not isinstance(value, str) or not value:
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return cls.register(value)

    @classmethod
    def register(cls, value: str):
        value = str.__str__(value)
        if value not in cls._interned:
            cls._interned[value] = str.__new__(cls, value)
        return cls._interned[value]

    @classmethod
    def unregister(cls, value: str) -> None:
        cls._interned.pop(str.__str__(value), None)

    @classmethod
    def registered(cls) -> list:
        return list(cls._interned.values())

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __reduce__(self):
        return type(self), (self.value,)
