"""The extraction job: every sample through the server with capture on, verified, recorded once."""
