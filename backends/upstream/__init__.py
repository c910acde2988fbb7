"""The transport to backends: our HTTP/1.1 client, idle watchdog, and the error mapping."""
