"""Serving on Ray Serve: the router, its config and route state, the policy app, hosting."""
