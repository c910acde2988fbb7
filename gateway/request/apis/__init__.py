"""One module per API the gateway routes, each implementing ``gateway.request.api.Api`` for
what it does differently; the endpoints' table (``gateway.request.endpoints``) names the API of
every endpoint. An API that does nothing differently is ``gateway.request.api.PLAIN``."""
