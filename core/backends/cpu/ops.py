"""Imports every module of compiled CPU kernels, so that each registers its binders."""
from ggrun.core.backends.cpu import norm  # noqa: F401
from ggrun.core.backends.cpu import rope  # noqa: F401
from ggrun.core.backends.cpu import elementwise  # noqa: F401
from ggrun.core.backends.cpu import matmul  # noqa: F401
from ggrun.core.backends.cpu import experts  # noqa: F401
from ggrun.core.backends.cpu import attention  # noqa: F401
from ggrun.core.backends.cpu import sample  # noqa: F401
