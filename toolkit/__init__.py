"""meshkit's toolkit: the commands users type (toolkit/*.py, each only its flags and cli()) over
one subpackage per concern: data, training, pod, inference, tuning (see README.md, Layout)."""
