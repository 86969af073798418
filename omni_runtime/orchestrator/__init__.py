"""The orchestrator process's parts: one `SlotService` per slot served, the watches."""
