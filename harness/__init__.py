"""MLPerf Training benchmark harness: launch, log, and score distributed PyTorch training.

The Python API (harness.api: start, attach, dry_run, Campaign; docs/api.md) is imported on first use, so that `import harness`
stays as light as the report path needs."""

__version__ = "0.1.0"

_API = ("start", "attach", "dry_run", "Campaign", "CampaignTimeout", "DryRun", "Status", "JobState", "HarnessError")


def __getattr__(name: str):
    if name in _API:
        from harness import api

        return getattr(api, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
