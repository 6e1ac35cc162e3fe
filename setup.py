"""The native pieces: kvstore._copyhash (fused page copy + checksum; a page's socket receive or
send hashed as it goes), kvstore._keys (chained page keys) and kvstore._lookup (a lookup's
per-key loops: the directory's prefix walk, the key-length check). Everything else is in
pyproject.toml. ``optional=True``: without a C compiler the install still succeeds;
kvstore.pagecopy uses numpy (same bytes, same checksums, slower), kvstore.keys hashlib (same
keys, slower), the directory and kvstore.validate Python loops (same answers, slower) and the TCP
data plane a Python loop per chunk. The C sources are in csrc/ (one folder of their own, DESIGN §2);
the modules they build stay ``kvstore._copyhash``, ``kvstore._keys`` and ``kvstore._lookup``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstore._copyhash", ["csrc/_copyhash.c", "csrc/_scatter.c", "csrc/_sockhash.c"],
                             depends=["csrc/_copyhash.h"], extra_compile_args=["-O3"], optional=True),
                   Extension("kvstore._keys", ["csrc/_keys.c"], extra_compile_args=["-O3"], optional=True),
                   Extension("kvstore._lookup", ["csrc/_lookup.c"], extra_compile_args=["-O3"], optional=True)])
