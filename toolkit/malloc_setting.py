"""`python -m toolkit.malloc_setting`: prints the GLIBC_TUNABLES this command runs with, after
toolkit/allocator.py's re-start (glibc rewrites its own copy in /proc/PID/environ)."""
import os

if __name__ == "__main__":
  print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')}")
