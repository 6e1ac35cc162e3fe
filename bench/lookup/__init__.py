"""`kvstore-bench lookup`: the directory lookup tail, idle and while the demoter drains, beside a bare
Unix-socket round trip (the floor)."""
