"""The pure cores: SPEC §2 types and §3 routing. No I/O, no threads; imports only `core/`."""
