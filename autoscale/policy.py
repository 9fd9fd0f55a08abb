"""The import path Serve configs written before the autoscaling policy's file was renamed
name (`iterserve.autoscale.policy:KVAutoscalingPolicy`); the policy lives in
`autoscaling_policy.py`. tests/unit/test_import_paths.py imports both."""

from iterserve.autoscale.autoscaling_policy import KVAutoscalingPolicy

__all__ = ["KVAutoscalingPolicy"]
