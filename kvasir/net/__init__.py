"""Network services shared by the API, the market and the window seeder (one HTTP server path)."""
