"""Storage tiers behind one small interface (see base.py). Import as ``kvstore.tiers``."""
