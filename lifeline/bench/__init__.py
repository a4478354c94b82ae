"""`lifeline bench`: a load generator and metric report for any OpenAI-compatible server."""
