"""The CPU backend's binder table (core/backends/binders.py): its kernel modules register with
`@binds(op, scratch=...)`; where no binder takes a node, the reference array kernel runs."""
from __future__ import annotations

from ggrun.core.backends.binders import BinderTable

TABLE = BinderTable()
binds = TABLE.binds
scratch_bytes = TABLE.scratch_bytes
bind = TABLE.bind
