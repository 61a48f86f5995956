"""What a user can fix: the base of every error about what they gave us (a path, a model we
cannot serve, a flag value, a repository this machine cannot run). The CLI prints such an error
as one line naming the problem and what to do, and exits 2; anything else is our bug and keeps
its traceback. Knows: nothing else; every layer may import it.
"""


class UserError(Exception):
    """A problem in the user's input or setup, worded for them (what is wrong, what to do)."""


class ManifestMissing(UserError, FileNotFoundError):
    """No engine manifest where one was expected: the repository was not built."""


class ManifestMismatch(UserError, ValueError):
    """A manifest this version cannot read (built by another version)."""


class NoChatTemplate(UserError, ValueError):
    """Chat messages for a model without a chat template (a base model), which continues plain
    text: the caller must send the prompt as is."""
