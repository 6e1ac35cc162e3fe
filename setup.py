"""The one native piece: kvstore._copyhash (fused page copy + checksum; a page's socket receive
or send hashed as it goes). Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install still succeeds and
kvstore.pagecopy uses numpy (same bytes, same checksums, slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstore._copyhash", ["kvstore/_copyhash.c", "kvstore/_scatter.c", "kvstore/_sockhash.c"], depends=["kvstore/_copyhash.h"],
                             extra_compile_args=["-O3"], optional=True)])
