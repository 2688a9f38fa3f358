"""What the Serve controller runs for the platform: the autoscaling policies (`autoscaling`)."""
