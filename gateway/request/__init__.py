"""The request path: parse, admit, route, attempt, relay, release."""
