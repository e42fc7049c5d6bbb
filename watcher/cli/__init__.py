"""The command line: argparse, the commands, and what they print (nothing here runs in the daemon)."""
