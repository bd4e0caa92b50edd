"""The market's server half: the SQLite store and the HTTP service. It never imports the node agent."""
