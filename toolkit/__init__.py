"""meshkit's toolkit: the commands users type (toolkit/*.py, each only its flags and cli()) over
one subpackage per concern: data, training, pod, inference, tuning (see README.md, Layout).

A command starts with glibc's huge-page malloc setting, as `make` gives it (toolkit/allocator.py):
this package re-starts `python -m toolkit.NAME` once with it, before anything heavy loads."""
from toolkit import allocator as _allocator

_allocator.restart_with_huge_pages()
