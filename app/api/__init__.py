"""The REST service: Litestar app factory (``app.api.app.create_app``), controllers per domain,
msgspec structs."""
