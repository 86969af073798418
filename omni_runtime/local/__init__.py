"""What runs a deployment on one machine (`run`, `serve`, the tests): a private
redis-server, Redis Cluster or Sentinel set, and the processes of a pipeline, forked or spawned, which
die with their parent."""
