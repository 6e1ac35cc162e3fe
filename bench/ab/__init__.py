"""A/B scripts of single changes, kept so the figures DESIGN cites can be measured again:
``python -m kvstore.bench.ab.<module> --help``-free, see each module's docstring."""
