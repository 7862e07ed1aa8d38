"""MLPerf Training benchmark harness: launch, log, and score distributed PyTorch training.

The Python API (harness.api: start, attach, dry_run, Campaign; harness.compare: compare_paths, the CI gate's
verdicts as data; docs/api.md) is imported on first use, so that `import harness` stays as light as the report path
needs."""

__version__ = "0.1.0"

# name -> the module that defines it
_API = {**dict.fromkeys(("start", "attach", "dry_run", "Campaign", "CampaignTimeout", "DryRun", "Status", "JobState",
                         "HarnessError"), "harness.api"),
        **dict.fromkeys(("compare_paths", "Verdict"), "harness.compare")}


def __getattr__(name: str):
    if name in _API:
        from importlib import import_module

        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
