"""The package version, in one place for fastagg/__init__.py and env_report (pyproject.toml states the same)."""
__version__ = "0.1.0"
