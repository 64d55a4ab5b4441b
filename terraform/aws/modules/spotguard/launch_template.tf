# One launch template per job. Its default user-data is the job's FIRST boot: write the agent
# config, start the job's command under spotguard, start the agent. When the controller
# relaunches the job it passes its own user-data (contracts.Assignment.user_data(): write
# /etc/spotguard/assignment.json, restart the agent), which replaces this one: the agent then
# restores the image instead of starting the command afresh.
resource "aws_launch_template" "job" {
  for_each = var.jobs

  name                   = "${var.name}-${each.key}"
  description            = "spotguard GPU instance for job ${each.key}"
  image_id               = var.ami_id
  instance_type          = coalesce(each.value.instance_type, var.instance_type)
  key_name               = var.key_name
  ebs_optimized          = true
  update_default_version = true
  vpc_security_group_ids = length(var.security_group_ids) > 0 ? var.security_group_ids : null

  iam_instance_profile {
    arn = aws_iam_instance_profile.agent[each.key].arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = var.metadata_hop_limit
    instance_metadata_tags      = "enabled"
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  user_data = base64encode(templatefile("${path.module}/templates/first-boot.sh.tftpl", {
    job                 = each.key
    store_url           = local.store_url
    controller_url      = var.controller_url
    insecure_controller = !var.controller_tls
    job_token           = lookup(var.job_tokens, each.key, null)
    key_sources = {
      signing = local.signing_key_source[each.key]
      verify  = local.verify_key_source[each.key]
    }
    command     = each.value.command
    paths       = local.spotguard
    run_command = format(local.spotguard.run_command, each.key, local.spotguard.job_script_path)
  }))

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
  }

  tags = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })

  lifecycle {
    precondition {
      condition     = var.controller_url == null || contains(nonsensitive(keys(var.job_tokens)), each.key)
      error_message = "controller_url is set but job_tokens has no token for this job: run `spotguard controller --issue-token <job>` on the controller host and add it to job_tokens."
    }
  }
}
