"""``serve --workers N``: several gateway processes on one port, one view of the fleet."""
