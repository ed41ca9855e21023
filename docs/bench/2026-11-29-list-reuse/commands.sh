# The corpus: the first 125,000 characters of the Debian Reference's ch01-02 as text (tags
# stripped), 28,170 tokens of the default model, ingested on the CPU:
#   kvdb ingest --store /tmp/reuse/store --corpus deb --index ivf256,np8,norope,all \
#       --index ivf256,np5,hp2,norope docs
# Then, with experiment.diff applied (prints the running totals every 24 decode searches):
for spec in ivf256,np8,norope,all ivf256,np5,hp2,norope flat; do
  for q in "How do I configure the network interfaces on a Debian system?" \
           "What does the apt-get command do when it upgrades packages?"; do
    KVDB_EXP_REUSE=1 kvdb ask --store /tmp/reuse/store --corpus deb --index $spec --max-tokens 64 "$q"
  done
done
