"""mossvox: profiles layer."""
