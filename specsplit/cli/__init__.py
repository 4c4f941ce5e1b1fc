"""The command line (`specsplit`), the service launcher and the gateway client."""
