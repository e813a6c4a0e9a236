"""Adapter versions named by digest: fetched, verified and cached on disk. Imports neither torch nor the
engine's config (a torch-free process can use it too); what is done with a file's bytes as they arrive
(loading's staging) comes in through an interface (download.Stage)."""
