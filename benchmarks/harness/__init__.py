"""What every scenario shares: processes, a private Redis, CPU accounting, stats and reports."""
