"""The planner: prefill, decode and mixed replica counts that meet the SLOs at the least GPU cost."""
