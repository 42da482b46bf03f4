"""`pollen audit`: what an honest-but-curious server rebuilds of a client's
examples from what it receives (`server_view`, `inversion`, `images`, the
command in `run`). Torch-free here: the CLI imports the errors."""


class AuditError(ValueError):
    """A configuration or flags the audit cannot take: fix them and retry."""


class AuditFailed(RuntimeError):
    """The audited client's training failed."""
